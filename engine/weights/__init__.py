"""The weight manager: versions, update transactions, update groups."""
