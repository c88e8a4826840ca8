"""``python -m hetu_ext.checkpoint inspect|verify|convert`` (see cli.py)."""

import sys

from .cli import main

sys.exit(main())
