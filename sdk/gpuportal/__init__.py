"""The GPU portal's SDK: what a team's training script imports to report progress, save checkpoints the
portal knows about, and learn that the portal asked it to stop."""
