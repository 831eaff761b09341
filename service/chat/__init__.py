"""Chat planning both chat doors share (minivllm.v1 messages and OpenAI chat): tool grammar, tool-call and reasoning parsers."""
