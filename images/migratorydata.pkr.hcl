# The migratorydata appliance: a Debian disk image with the DEB installed, the service enabled
# and nftables opening only SSH and the server's ports; with analytics_deb, the log analytics too.
# Packer 1.6.6 (Debian's) with its built-in qemu builder, so no required_plugins block. Run it
# through images/build_image.py, which validates the inputs and passes these variables:
#   python images/build_image.py build --base dist/debian-12-base.qcow2 --deb dist/migratorydata_0.1.0_amd64.deb

variable "base_image" {
  type        = string
  description = "Debian qcow2 to start from (images/base_image.py makes one from Debian's packages)."
}

variable "deb" {
  type        = string
  description = "The migratorydata DEB to install (make deb)."
}

variable "analytics_deb" {
  type        = string
  default     = ""
  description = "The migratorydata-analytics DEB to install too (PySpark and the log analytics, with Java 17 from Debian); empty: none."
}

variable "config" {
  type        = string
  description = "The migratorydata.conf of the image (build_image.py passes the packaged one unless told otherwise)."
}

variable "ports" {
  type        = list(number)
  default     = [8800, 1883]
  description = "TCP ports the firewall opens besides SSH: those of Listen, ListenEncrypted, ListenMqtt, ListenMqttEncrypted, MonitorHTTP.Listen."
}

variable "ssh_private_key_file" {
  type        = string
  description = "Private key whose public half is root's authorized key in the base image."
}

variable "output_directory" {
  type    = string
  default = "dist/image"
}

variable "vm_name" {
  type    = string
  default = "migratorydata.qcow2"
}

variable "accelerator" {
  type        = string
  default     = "tcg"
  description = "kvm where /dev/kvm is usable, else tcg (software emulation)."
}

variable "disk_size" {
  type        = string
  default     = "6144M"
  description = "The base image's size (images/base_image.py --size): the partition does not grow, so not more."
}

source "qemu" "migratorydata" {
  iso_url              = var.base_image
  iso_checksum         = "none"
  disk_image           = true
  use_backing_file     = false
  format               = "qcow2"
  disk_size            = var.disk_size
  disk_interface       = "virtio"
  net_device           = "virtio-net"
  accelerator          = var.accelerator
  headless             = true
  memory               = 1024
  cpus                 = 2
  boot_wait            = "1s"
  communicator         = "ssh"
  ssh_username         = "root"
  ssh_private_key_file = var.ssh_private_key_file
  ssh_timeout          = "20m"
  shutdown_command     = "systemctl poweroff"
  shutdown_timeout     = "5m"
  output_directory     = var.output_directory
  vm_name              = var.vm_name
}

build {
  sources = ["source.qemu.migratorydata"]

  provisioner "file" {
    source      = var.deb
    destination = "/root/migratorydata.deb"
  }

  provisioner "file" {
    source      = var.config
    destination = "/root/migratorydata.conf"
  }

  # The analytics DEB when given, else an empty marker: provision.sh installs it only if it is a package.
  provisioner "file" {
    source      = var.analytics_deb != "" ? var.analytics_deb : "${path.root}/provision.sh"
    destination = var.analytics_deb != "" ? "/root/migratorydata-analytics.deb" : "/root/no-analytics"
  }

  provisioner "file" {
    source      = "${path.root}/provision.sh"
    destination = "/root/provision.sh"
  }

  provisioner "shell" {
    environment_vars = ["PORTS=${join(" ", var.ports)}", "DEBIAN_FRONTEND=noninteractive"]
    inline           = ["sh /root/provision.sh"]
  }
}
