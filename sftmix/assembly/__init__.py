"""From finished slices to a published output: assembly in the global order, the run's outcome, whether a published output is already this run's."""
