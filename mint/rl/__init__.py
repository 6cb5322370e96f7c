"""The RL math and its inputs: GRPO advantages and objective, rewards, data streams, synthetic tasks.

Pure torch and the standard library: nothing here imports Ray, DeepSpeed or the model stack.
"""
