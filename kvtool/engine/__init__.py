"""The fake engine, scheduler and engine loop that drive a connector without a model."""
