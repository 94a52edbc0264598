"""The specgate gateway: OpenAI API, session routing, speculative fallback policy, worker fleet."""
