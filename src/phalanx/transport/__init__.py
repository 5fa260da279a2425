"""How rollouts and weights move between the policy and rollout replicas."""
