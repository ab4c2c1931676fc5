"""tokenize-mixer's pure core: a mixer of chat datasets becomes OLMo-core shards.

Nothing in this package imports Prefect; the flow in ``tokenize_mixer.flows`` and the tasks in ``tokenize_mixer.tasks`` are thin
wrappers over these functions, so the same steps can run from any Python program.
"""

__version__ = "0.1.0"
