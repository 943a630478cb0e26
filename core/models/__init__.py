"""Models: loading builder folders and preparing the default model."""
