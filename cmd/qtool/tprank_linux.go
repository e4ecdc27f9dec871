package main

import "syscall"

// rankProcAttr makes a rank process die with its launcher.
func rankProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
