"""What makes a network namespace a host: the namespace (netns), its sshd and the lab's users
(sshd), shims for what would act on this machine (shims), its own Docker engine and the lab's
registry (dockerd)."""
