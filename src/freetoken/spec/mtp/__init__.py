"""MTP speculative decoding: the checkpoint's own multi-token-prediction layer drafts k tokens."""
