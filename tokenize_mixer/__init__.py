"""tokenize-mixer as installed: the command line (``cli``, entered through ``command``), over the Prefect
flows (``tokenize_mixer.flows``) and tasks (``tokenize_mixer.tasks``), over the pure core ``sftmix``. Each layer imports only the ones below it (the import
contract in ``pyproject.toml``, checked in CI)."""
