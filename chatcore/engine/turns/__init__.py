"""One turn: input builder -> runner (agent loop) -> committer."""
