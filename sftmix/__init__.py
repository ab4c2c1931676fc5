"""tokenize-mixer's pure core: a mixer of chat datasets becomes OLMo-core shards.

Nothing in this package imports Prefect; the flow in ``flows/`` and the tasks in ``tasks/`` are thin
wrappers over these functions, so the same steps can run from any Python program.
"""

__version__ = "0.1.0"
