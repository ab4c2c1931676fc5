"""JSON Lines, read by batch as ``datasets``' JSON builder reads it: its files' batches counted, hashed and
read (``batches``), where a dataset's files are and how their batches are cut into slices (``files``), and the
plan's reader of a large file, cut into slices as it is read (``reader``)."""
