"""OpenAI wire protocol shared by the gateway, the built-in replica and bench stubs: request
structs, the error shape, SSE framing. Torch-free and aiohttp-light so every server uses it."""
