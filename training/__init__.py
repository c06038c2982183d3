"""Commands that build the embedded model's training data (and, later, train it). Never run by CI."""
