"""What a rank's memory holds: its sharded training state
(``sharded_state``) and, over a step, every tensor's lifetime by category
(``storage_tracker``), measured on real tensors or traced on FakeTensors.
"""
