"""The request data model: Req, sampling params, the radix namespace, the forward batch."""
