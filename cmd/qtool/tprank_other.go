//go:build !linux

package main

import "syscall"

// rankProcAttr: no parent-death signal outside Linux.
func rankProcAttr() *syscall.SysProcAttr { return nil }
