"""Live membership: which sites are members of each epoch, agreed through a store (the one-process coordinator's
TCPStore or an etcd cluster). It never imports the driver: the driver asks it.
"""
