"""Agentic RL: multi-turn episodes against ``verifiers`` environments, token-in/token-out,
tools in a sandbox, episodes that outlive their replica (docs/architecture.md, "Agentic
RL")."""
