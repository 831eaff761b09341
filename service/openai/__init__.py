"""The OpenAI-compatible HTTP front door: chat and text completions, the Responses API, tools."""
