"""The Anthropic Messages surface: `/v1/messages` and its token count."""
