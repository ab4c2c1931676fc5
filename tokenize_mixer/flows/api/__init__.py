"""The Prefect API a run talks to: the temporary one a command starts, and noticing a cancel or a lost API."""
