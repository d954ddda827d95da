"""What makes a network namespace a host: the namespace (netns), its sshd and the lab's users
(sshd), shims for what would act on this machine (shims), its own Docker engine (dockerd), and the
lab's registry the engines pull through (registry)."""
