"""A mixer becomes a plan: its datasets opened, rows selected, work cut into content-keyed slices; the recipe a run's bytes follow from; where a run may read and write."""
