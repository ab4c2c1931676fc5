"""From rows to tokens and masks: the tokenizer as the reference builds it, its encoders, chat templates and their renders, the assistant-only label mask, one slice's checkpoint."""
