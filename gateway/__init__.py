"""The kvgate gateway: aiohttp server, tokenization before routing, proxying to replicas, CLI."""
