"""The examples, images and the planner: what goes into a pack (torch-free where it can be)."""
