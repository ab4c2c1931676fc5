"""The plan's readers, one per way a dataset is read: each opens a dataset (its count, its sample) and cuts it into slices; what they share is in ``reader``."""
