"""The plan itself: stages, pipelines, layouts of tensors over ranks, batches, replicas, the cluster."""
