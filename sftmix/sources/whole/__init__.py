"""A dataset read whole before its slices are cut: a JSON Lines file counted by batch, or any dataset
``datasets`` reads (a hub dataset, a CSV, a file of another layout); the plan's last reader (``reader``)."""
