"""Patches of host frameworks, installed as ``hetu_ext.patches``: each named, probed and removable."""
