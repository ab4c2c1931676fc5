"""Reading datasets as ``datasets`` reads them: local, ``gs://`` and hub files by byte range or row group, JSON Lines and Parquet, rows as conversations."""
