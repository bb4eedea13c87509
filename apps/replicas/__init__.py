"""Who serves: workers (engine endpoints), their DP ranks, discovery and health."""
