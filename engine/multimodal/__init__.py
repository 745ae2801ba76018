"""Images in prompts: decoding, content hashes and the model's preprocessing."""
