"""autopipe.runtime: model + Plan -> running pipeline."""
