"""Per-rank workers (policy + reference + rollout engine; critic), their objectives, and Ray worker groups."""
