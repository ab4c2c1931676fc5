"""The parts of the ``tokenize-mixer`` command line that ``tokenize_mixer.cli`` is made of: its flags, what
they make, the progress it shows, a run of the flow, ``inspect``. Below the command line's entry and above
the flows (the layers in pyproject.toml)."""
