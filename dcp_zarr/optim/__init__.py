"""Optimizer state across key forms: the param-id tables the manifest records, the load planner that translates
between FQN, int-id and flattened keys, wrapper-prefix tolerance, and the step checks."""
