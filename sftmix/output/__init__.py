"""The output as written: OLMo-core parts and statistics, the Hugging Face layout, digests, the output directory, publishing, the run's report."""
