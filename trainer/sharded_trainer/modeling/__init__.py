"""The network a config names, built on the meta device: the bundled decoder, Hugging Face models, NF4 bases."""
