"""Parquet, read by row group as ``datasets``' Parquet builder reads it: its footers counted, its row groups
hashed and read (``row_groups``), a large row group decoded once for all its slices (``spill``), and the plan's
reader, cutting slices as the row groups are hashed (``reader``)."""
