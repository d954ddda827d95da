"""The AWS target in the lab: GPU nodes as namespaces that run the launch template's user data
and every SSM association the program registered, the AWS APIs the nodes call (IMDSv2, S3, SSM
Parameter Store, ELBv2) with the node role's policy checked on each call, and HAProxy standing
in for the NLB (docs/lab.md, "The AWS target in the lab")."""
