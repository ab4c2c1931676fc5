"""Prefect flows of tokenize-mixer."""
