"""Where slices run: the command's process pool forked from a preloaded server, its head start while the API starts, a work pool of other machines."""
