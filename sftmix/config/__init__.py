"""What a user writes: the mixer and run options (pydantic), how each setting reaches the bytes, mixer amounts and the rows they select, the UI form, the reference's flags."""
