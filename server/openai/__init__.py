"""The OpenAI surfaces: chat completions, legacy completions, their request models and
logprobs wire shapes (the Responses API has its own folder, `server/responses/`)."""
