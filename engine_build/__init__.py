"""Build the demo model's inputs from offline text: the corpus (`corpus`), the tokenizer (`tokenizer`)."""
