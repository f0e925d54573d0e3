"""Models: the Llama-family decoder, its configuration, tokenizers and loading."""
