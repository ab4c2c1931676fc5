"""Thin Prefect tasks over ``sftmix``: one module per stage."""
