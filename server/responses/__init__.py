"""The OpenAI Responses API: `/v1/responses`, its output items and stored responses."""
