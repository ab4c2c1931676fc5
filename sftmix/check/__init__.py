"""Looking at an output: ``tokenize-mixer check`` and what OLMo-core will make of it, one document decoded, the report page."""
